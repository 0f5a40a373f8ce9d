"""The compressed disk tier: the service, its file store and the checked file format."""
