"""Model families, one per file, and the registry that maps `config.architectures` to them."""
