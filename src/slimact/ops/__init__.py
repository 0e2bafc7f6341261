"""Reformulated ops: autograd Functions, Triton kernels and their ``*_ref`` references."""
