from slimact.cli import entry

entry()
