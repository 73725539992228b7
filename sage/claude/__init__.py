"""Everything specific to Claude Code: the stream-json codec, the binary and its versions, hooks, principals' homes."""
