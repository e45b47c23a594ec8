"""End-to-end tests across the parts: the demo, the launcher, two hosts."""
