"""The Dynamo backend: fragment capture, AOTAutograd wiring, inner compilers, fallback detection."""
