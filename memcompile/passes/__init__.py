"""Graph analyses and (later) planning and rewrite passes over AOT forward/backward graphs."""
