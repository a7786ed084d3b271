"""Factories for `graphshard dump` tests: good ones, and each kind of bad one."""
