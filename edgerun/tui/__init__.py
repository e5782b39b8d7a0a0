"""The Textual chat app."""
