def broken(prompt, response, **fields):
    return 1.0 / 0
