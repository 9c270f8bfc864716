"""Runtime: drafters, sessions, the plain and speculative decoders, the engine."""
