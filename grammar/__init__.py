"""The netdsl grammar (package data)."""
