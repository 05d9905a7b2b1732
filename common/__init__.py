"""What every Prism process shares: config loading, logging, and the model
families (how each family's images become tokens). Nothing here imports a
service, the launcher or the demo tooling (`prism/`)."""
