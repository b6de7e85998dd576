package engine_test

import (
	"context"
	"log"
	"time"

	"github.com/kvpersist/kvpersist/engine"
)

// Example_remoteTier puts an S3 bucket behind the local store: here a
// SeaweedFS server on this machine, which speaks plain HTTP, so the
// endpoint says http:// (plain HTTP is accepted for a loopback host
// only; a bare host[:port] means HTTPS). Credentials come from
// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY. This is the README's
// object-store example; it is compiled, not run (it needs the server).
func Example_remoteTier() {
	root := "/nvme/kv"

	// README:begin (README.md, "Object-store tier", shows the lines up to README:end)
	e, err := engine.New(engine.Config{
		Root:          root,
		CapacityBytes: 64 << 30,
		Remote: &engine.RemoteTier{
			// endpoint, bucket (it must exist), key prefix in the bucket
			Store: engine.RemoteConfigFromEnv("http://127.0.0.1:8333", "kvcache", "fleet-a"),
		},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := e.Close(ctx); err != nil { // waits for pending uploads until ctx ends
			log.Print(err) // errors.Is(err, engine.ErrUploadsAbandoned): they stay journaled
		}
	}()
	// README:end
}
