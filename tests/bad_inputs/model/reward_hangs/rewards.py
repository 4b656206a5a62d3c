import time


def stuck(prompt, response, **fields):
    time.sleep(600)
    return 1.0
