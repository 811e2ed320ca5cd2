"""The netdsl standard library of .net blocks (package data)."""
