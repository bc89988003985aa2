"""Roles: the engine-independent logic of each worker role (reward scoring, ...).

Modules here import nothing heavy at import time, so a role's logic is testable without torch.
"""
