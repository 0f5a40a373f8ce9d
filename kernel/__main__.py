from unikern.frontends.cli import entry

entry()
