"""The HTTP server: llama-server's, OpenAI's, Anthropic's and Vertex's APIs over one engine worker."""
