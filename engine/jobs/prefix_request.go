package jobs

// SavePrefixRequest saves the token pages of a KV cache to the prefix cache
// of Namespace (<root>/<Namespace>/pages, root being Config.Root): only
// pages not stored yet are gathered, hashed and written (see SavePrefix).
// The views' memory, and the request, must stay valid and unchanged until
// the save returns (for the engine: until the ack).
type SavePrefixRequest struct {
	// Namespace is a single path element (layout.ValidName); pages go
	// where engine/store puts them (store.Namespace.PagePath).
	Namespace string
	// Identity names everything that makes KV incompatible (model weights
	// digest, KV dtype, layout, tensor-parallel rank: the caller decides);
	// 1 to layout.MaxIdentityBytes bytes. It roots the key chain.
	Identity string
	// Tokens are the token ids whose KV Tensors hold, in order; at least 1.
	Tokens []uint32
	// Tensors is every tensor of the cache (all layers, K and V), each a
	// dtype and a strided view of at least 2 axes whose axis -2 is the
	// token axis, holding at least len(Tokens) tokens (a capacity-padded
	// buffer's first len(Tokens) tokens are saved; the rest is ignored).
	Tensors []TensorSpec
	// PageTokens is P, tokens per page; 0 means layout.DefaultPageTokens
	// (256).
	PageTokens int
	// Progress, when non-nil, is called with n > 0 each time n more bytes
	// of the save are done: a page's tensor bytes (its tokens' share of
	// every tensor; headers and alignment not counted) once the page was
	// found stored or has been published (fdatasynced and renamed; its
	// directory's fsync comes later), so a page that fails to publish is
	// never counted. The calls of one save add up to len(Tokens) tokens'
	// bytes of every tensor when it succeeds, and to less when it fails.
	// It is called on the save's goroutine only, never after SavePrefix
	// returns (for the engine: never after the ack), and must be quick.
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
