"""Exceptions a verifier raises to tell the pool something other than a score."""


class VerifierTimeout(Exception):
    """The verifier gave up on this completion because it ran out of time (scored 0, counted)."""
