def scorer(prompt, response, **fields):
    return 0.0
