raise RuntimeError("no API key")
