"""The torch_asgc library's tests (``pytest tests/test_torch_asgc -q``): its TCP and gRPC transports, AMP,
DDP comm hooks on DDP's gradient buckets, compression with error feedback, and the Lightning and Hugging Face
plugins, each against a real server in this process; the slow ones (marked ``slow``) train with worker
processes and run docs/library.md's examples as written. Their shared models and servers:
tests/library_fixtures.py (the root tests use them too)."""
