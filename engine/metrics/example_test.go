package metrics_test

import (
	"fmt"
	"time"

	"github.com/kvpersist/kvpersist/engine/metrics"
	"github.com/prometheus/client_golang/prometheus"
)

// A scheduler registers the recorder in its own registry (serve it with
// promhttp.HandlerFor(reg, ...)) and hands it to the engine as
// engine.Config{Metrics: rec}.
func Example() {
	rec, err := metrics.New(metrics.Options{})
	if err != nil {
		panic(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(rec)

	rec.Job(metrics.KindSave, metrics.OutcomeOK, 3*time.Millisecond, true) // as the engine does
	rec.Bytes(1<<20, 0, 0)

	families, err := reg.Gather()
	if err != nil {
		panic(err)
	}
	for _, f := range families {
		if f.GetName() == "kvpersist_written_bytes_total" {
			fmt.Println(f.GetName(), f.GetMetric()[0].GetCounter().GetValue())
		}
	}
	fmt.Println(rec.Snapshot().Jobs)
	// Output:
	// kvpersist_written_bytes_total 1.048576e+06
	// [{save ok 1}]
}
