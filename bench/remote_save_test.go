package bench

import (
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/kvpersist/kvpersist/engine"
	"github.com/kvpersist/kvpersist/internal/seaweedfs"
)

// BenchmarkPrefixRemoteSave: BenchmarkPrefix's save rows (save-empty:
// 8,192 tokens, 32 new pages; save-grow: one new page) on an engine
// whose object-store tier is a real SeaweedFS on loopback, started by the
// benchmark (not counted), each beside the same raw write + fdatasync
// limit as the local rows. It shows what write-behind costs a save's ack:
// enqueueing every new page (a descriptor and its uploads-journal
// record; the journal is written and fdatasync'd by its own goroutine)
// while the uploads of earlier iterations run in the background. The
// tier's RefreshAge is 1 ns, so no page stays known stored and every save
// queues (and journals) all its new pages; the store holds them after the
// untimed warm-up, so each upload is one HEAD. Compare x-limit with
// BenchmarkPrefix's rows of the same run.
func BenchmarkPrefixRemoteSave(b *testing.B) {
	srv := seaweedfs.StartTB(b) // fails (never skips) when weed cannot be built
	w := getWorkload(b, benchModel, prefixTokens)
	prefix := fmt.Sprintf("bench-save-%d", os.Getpid())
	withTier := func(root string) *engine.Engine {
		e, err := engine.New(engine.Config{Root: root, Logger: quietLogger, Remote: &engine.RemoteTier{
			Store: engine.RemoteConfig{Endpoint: srv.Endpoint, Bucket: srv.Bucket, Prefix: prefix,
				AccessKey: srv.AccessKey, SecretKey: srv.SecretKey},
			RefreshAge: time.Nanosecond,
		}})
		if err != nil {
			b.Fatal(err)
		}
		return e
	}
	b.Run("save-empty", func(b *testing.B) { benchPrefixSaveEmpty(b, w, withTier) })
	b.Run("save-grow", func(b *testing.B) { benchPrefixSaveGrow(b, w, withTier) })
}
