"""Quota: guaranteed quota per queue and GPU flavor; reservations, releases and retries."""
