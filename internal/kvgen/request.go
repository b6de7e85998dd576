package kvgen

import (
	"strconv"

	"github.com/kvpersist/kvpersist/engine/gather"
	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/kvpersist/kvpersist/engine/layout"
)

// CacheRequest describes the first tokens tokens of c the way mlx-lm's
// caches are saved: per layer one entry {"type":"KVCache","offset":T} with
// K and V (views of the capacity-padded buffers), then one attachment
// {"name":"tokens"} with the int32 token ids; top-level metadata is the
// model's name and the token count.
func CacheRequest(c *Cache, tokens int) (caches, attachments []jobs.EntrySpec, meta layout.Meta) {
	views, dtypes := c.ViewsAt(tokens), c.DTypes()
	off := layout.Meta{"type": []byte(`"KVCache"`), "offset": []byte(strconv.Itoa(tokens))}
	for l := 0; l < c.Model.Layers; l++ {
		caches = append(caches, jobs.EntrySpec{Meta: off, Tensors: []jobs.TensorSpec{
			{DType: dtypes[2*l], View: views[2*l]}, {DType: dtypes[2*l+1], View: views[2*l+1]},
		}})
	}
	last := len(views) - 1
	attachments = []jobs.EntrySpec{{Meta: layout.Meta{"name": []byte(`"tokens"`)},
		Tensors: []jobs.TensorSpec{{DType: dtypes[last], View: views[last]}}}}
	meta = layout.Meta{"model": []byte(strconv.Quote(c.Model.Name)), "tokens": []byte(strconv.Itoa(tokens))}
	return caches, attachments, meta
}

// ArenaViews returns one tensor per K and V of every layer (layer 0 K,
// layer 0 V, layer 1 K, ...) viewing the first tokens tokens of
// capacity-padded buffers of capTok tokens carved in that order from arena
// (at least 2 × Layers × TensorBytes(capTok) bytes), strides in elements as
// mlx-lm keeps them: [KVHeads×capTok×HeadDim, capTok×HeadDim, HeadDim, 1].
func (m Model) ArenaViews(arena []byte, capTok, tokens int) []jobs.TensorSpec {
	tb := m.TensorBytes(capTok)
	out := make([]jobs.TensorSpec, 2*m.Layers)
	for i := range out {
		out[i] = jobs.TensorSpec{DType: m.DType, View: gather.View{
			Base:     arena[i*tb : (i+1)*tb : (i+1)*tb],
			Shape:    []int{1, m.KVHeads, tokens, m.HeadDim},
			Strides:  []int{m.KVHeads * capTok * m.HeadDim, capTok * m.HeadDim, m.HeadDim, 1},
			ItemSize: m.ItemSize,
		}}
	}
	return out
}
