"""`unikern serve`: an OpenAI- and Anthropic-compatible HTTP front door over one Engine.

Importing this package is cheap (spec.py reads `params`); the ASGI stack loads with `app`."""
