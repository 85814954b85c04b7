"""Metrics: pure functions on numpy arrays (tensor metrics here and in `tensor`, audio in `audio`)."""
