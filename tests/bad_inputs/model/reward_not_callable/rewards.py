score = 3
