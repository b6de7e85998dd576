package jobs

// SavePrefixRequest saves the token pages of a KV cache to the prefix cache
// of Namespace (<root>/<Namespace>/pages): only pages not stored yet are
// gathered, hashed and written. Every field follows SavePrefixSpec's rules.
// The views' memory, and the request, must stay valid and unchanged until
// the save returns (for the engine: until the ack).
type SavePrefixRequest struct {
	Namespace  string
	Identity   string
	Tokens     []uint32
	Tensors    []TensorSpec
	PageTokens int // 0 means layout.DefaultPageTokens (256)
	// Progress, when non-nil, is told how many more bytes are done (see
	// SavePrefixSpec.Progress).
	Progress func(bytes int64)
}

// LoadPrefixRequest loads the longest stored prefix of Tokens from the
// prefix cache of Namespace into Dest (one capacity-padded strided view per
// tensor, room for len(Tokens) tokens on axis -2); see LoadPrefixSpec and,
// for what each destination holds after every outcome, LoadPrefix. Dest
// must stay valid until the load returns (for the engine: until the ack).
type LoadPrefixRequest struct {
	Namespace  string
	Identity   string
	Tokens     []uint32
	Dest       []TensorSpec
	PageTokens int // 0 means layout.DefaultPageTokens (256)
	Verify     bool
	// Progress, when non-nil, is told how many more bytes are done (see
	// LoadPrefixSpec.Progress).
	Progress func(bytes int64)
}

func (*SavePrefixRequest) request() {}
func (*LoadPrefixRequest) request() {}
