"""Getting expert records from disk into memory. Never computes; never imports compute/."""
