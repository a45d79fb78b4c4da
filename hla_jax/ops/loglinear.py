"""Placeholder."""


def gated_deltanet(*a, **k):
    raise NotImplementedError


def loglinear_mamba2(*a, **k):
    raise NotImplementedError


def loglinear_gated_deltanet(*a, **k):
    raise NotImplementedError
