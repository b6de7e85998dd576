package engine_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/engine/metrics"
	"github.com/prometheus/client_golang/prometheus"
)

// Example_boundedCacheMetrics bounds the prefix cache (a capacity for the
// whole store, a quota for one namespace) and wires the metrics recorder
// into the scheduler's own registry. The recorder's cache gauges call
// Engine.Usage at each scrape through a closure over the variable that
// engine.New assigns, never a method value of a nil engine. This is the
// README's metrics example.
func Example_boundedCacheMetrics() {
	ctx := context.Background()
	root, err := os.MkdirTemp("", "kvpersist-metrics-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(root)

	// README:begin (README.md, "Metrics", shows the lines up to README:end)
	reg := prometheus.NewRegistry() // the scheduler's own registry; kvpersist registers nothing globally
	var e *engine.Engine            // assigned by engine.New below; read at each scrape
	rec, err := metrics.New(metrics.Options{Usage: func() engine.Usage { return e.Usage() }})
	if err != nil {
		log.Fatal(err)
	}
	reg.MustRegister(rec)
	e, err = engine.New(engine.Config{
		Root:          root,
		Metrics:       rec,
		CapacityBytes: 64 << 30,                               // page files of every namespace, allocated bytes
		QuotaBytes:    map[string]int64{"tenant-a": 16 << 30}, // one namespace's share
		HeadroomBytes: 8 << 30,                                // free space left to other writers of the disk
	})
	if err != nil {
		log.Fatal(err)
	}
	defer e.Close(ctx)
	// README:end

	families, err := reg.Gather()
	if err != nil {
		log.Fatal(err)
	}
	for _, f := range families {
		switch f.GetName() {
		case "kvpersist_cache_capacity_bytes", "kvpersist_cache_quota_bytes":
			for _, m := range f.GetMetric() {
				fmt.Printf("%s %.0f\n", f.GetName(), m.GetGauge().GetValue())
			}
		}
	}
	// Output:
	// kvpersist_cache_capacity_bytes 68719476736
	// kvpersist_cache_quota_bytes 17179869184
}
