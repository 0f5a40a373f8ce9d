"""The front doors over one Engine: the command line, the NDJSON worker (and its protocol)."""
