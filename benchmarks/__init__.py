"""Benchmarks: side-by-side measurements run by hand or through `akv bench`; they are not tests."""
