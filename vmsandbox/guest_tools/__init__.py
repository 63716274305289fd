"""Programs that vmsandbox ships to guests over SSH and runs there (package data)."""
