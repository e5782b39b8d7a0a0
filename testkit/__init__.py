"""Builders of test fixtures, used by the tests and scripts only and never installed with edgerun:
a tiny random-weight HF checkpoint (tiny.py) and a GGUF turned back into an HF checkpoint
(fixture.py, its tokenizer half in fixture_vocab.py). pytest finds this package through
pyproject's `pythonpath`; scripts put the repository root on sys.path."""
