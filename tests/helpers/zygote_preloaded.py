"""A module the test zygote preloads that registers an exit handler when imported, as torch,
pyarrow and Ray do: tests/test_zygote.py checks that it runs where it would in a fresh
interpreter (before the command's own first handler)."""

import atexit

atexit.register(print, "a preloaded module's exit handler ran")
