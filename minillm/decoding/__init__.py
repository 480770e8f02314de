"""Beating one-token-at-a-time decoding (chapters 7-9): speculative decoding with a draft
model, prompt lookup, lookahead (Jacobi) decoding and Medusa heads, each verified by the target
so that greedy output is unchanged.
"""
