"""Frameworks around torchpipe: Accelerate and transformers' Trainer, Ray Data. The top floor:
these modules may import anything in torchpipe, and nothing in torchpipe imports them. Each
imports its framework only when used and names the extra that installs it when it is missing.
"""
