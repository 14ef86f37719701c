"""The model factory: the GGUFs Spark builds for demos and tests (the upcycled SmolLM2 demo model,
its routers, the tiny random model of each family, the sparse geometry fixtures), all written
through gguf_write."""
