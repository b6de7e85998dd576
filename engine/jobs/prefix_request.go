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
// prefix cache of Namespace (<root>/<Namespace>/pages) into Dest; see
// LoadPrefix for the order of its checks and for what each destination
// holds after every outcome. Dest must stay valid until the load returns
// (for the engine: until the ack).
type LoadPrefixRequest struct {
	// Namespace is the namespace directory's name under the root (one
	// path element, layout.ValidName).
	Namespace string
	// Identity names everything that makes KV incompatible, as the save
	// gave it (1 to layout.MaxIdentityBytes bytes); another identity is a
	// miss by construction (it roots the key chain).
	Identity string
	// Tokens are the prompt's token ids; at least 1.
	Tokens []uint32
	// Dest has one destination per tensor of the cache, in the saved
	// order: a dtype and a strided view (capacity-padded as mlx-lm keeps
	// them) of the saved tensor's shape except axis -2, which must hold at
	// least len(Tokens) tokens. No two elements may share a byte, within
	// one view (gather.View.CheckNoOverlap) or between two
	// (gather.CheckDisjoint), else ErrDestination.
	Dest       []TensorSpec
	PageTokens int // 0 means layout.DefaultPageTokens (256)
	// NoVerify skips hashing the pages' tensors. The zero value verifies
	// every tensor of every page against its xxh3-64: a page that fails
	// ends the prefix there: PrefixResult.Tokens stops before it and
	// PrefixResult.Stop wraps ErrCorrupt (the destination's tokens from
	// that page on may hold partial data; see LoadPrefix). With NoVerify
	// a flipped byte in a page is loaded as good KV (headers, keys and
	// token ids are still checked): set it only where a wrong byte cannot
	// reach a model.
	NoVerify bool
	// Progress, when non-nil, is called with n > 0 each time one page
	// tensor of n bytes has been read into its destination (and verified,
	// unless NoVerify); a tensor that fails is not counted. When every page
	// found loads, the calls add up to the loaded tokens' bytes of every
	// tensor. It may be called from several of the load's goroutines at
	// once (it must be safe for concurrent use and quick), never after
	// LoadPrefix returns (for the engine: never after the ack).
	Progress func(bytes int64)
}

func (*SavePrefixRequest) request() {}
func (*LoadPrefixRequest) request() {}
