"""The vision encoder service: batched ViT encoding with a visual-token cache."""
