package engine_test

import (
	"context"
	"testing"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/metrics"
	"github.com/kvpersist/kvpersist/internal/kvgen"
	"github.com/prometheus/client_golang/prometheus"
)

var _ engine.UsageSink = (*metrics.Recorder)(nil)

// The documented wiring of the cache gauges: a Recorder made without
// Options.Usage and given to engine.New as Config.Metrics shows that
// engine's Usage. The gauges, scraped through a registry, equal the
// allocated bytes of the page files on disk and the configured capacity
// (taking eng.Usage before New returned bound a nil engine: gauges of 0).
func TestMetricsCacheGaugesWiredByNew(t *testing.T) {
	root := t.TempDir()
	const capacity = 1 << 30
	rec, err := metrics.New(metrics.Options{})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(rec)
	e, err := engine.New(engine.Config{Root: root, NoSync: true, Workers: 2, Logger: discardLogger, Metrics: rec, CapacityBytes: capacity})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := e.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
	}()
	m := kvgen.Tiny
	const tokens = 64
	c := kvgen.NewCache(m, tokens, true, nil)
	views := c.ViewsAt(tokens)
	ts := make([]engine.TensorSpec, 2*m.Layers)
	for i := range ts {
		ts[i] = engine.TensorSpec{DType: m.DType, View: views[i]}
	}
	ids := make([]uint32, tokens)
	for i := range ids {
		ids[i] = uint32(7 + i)
	}
	res := e.Do(context.Background(), &engine.SavePrefixRequest{Namespace: "ns", Identity: "usage/tiny", Tokens: ids, Tensors: ts, PageTokens: 16})
	if res.Err != nil || res.Prefix.PagesWritten != tokens/16 {
		t.Fatalf("save: %v %+v", res.Err, res.Prefix)
	}
	var onDisk int64
	files := pageFiles(t, root, "ns")
	for _, f := range files {
		onDisk += f[1]
	}
	if onDisk == 0 || len(files) != tokens/16 {
		t.Fatalf("page files on disk: %v", files)
	}

	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, mt := range mf.GetMetric() {
			if mt.GetGauge() == nil {
				continue
			}
			name := mf.GetName()
			for _, l := range mt.GetLabel() {
				name += "," + l.GetName() + "=" + l.GetValue()
			}
			got[name] = mt.GetGauge().GetValue()
		}
	}
	for name, want := range map[string]float64{
		"kvpersist_cache_capacity_bytes":          capacity,
		"kvpersist_cache_used_bytes,namespace=ns": float64(onDisk),
		"kvpersist_cache_pages,namespace=ns":      tokens / 16,
	} {
		if got[name] != want {
			t.Errorf("%s = %v, want %v (gauges: %v)", name, got[name], want, got)
		}
	}
	if s := rec.Snapshot(); s.Cache == nil || s.Cache.UsedBytes != onDisk {
		t.Errorf("Snapshot().Cache = %+v, want %d used bytes", s.Cache, onDisk)
	}
}
