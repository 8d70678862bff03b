"""The seed scheduler API."""
