"""The rank runtime: starting, reusing and stopping simulated ranks, and the messages between them."""
