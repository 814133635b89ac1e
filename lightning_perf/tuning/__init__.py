"""The auto-tuner: measures a user's own model and recommends the fastest safe configuration."""
