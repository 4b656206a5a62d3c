def score(prompt):
    return 1.0
