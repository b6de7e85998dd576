package seaweedfs

import (
	"bytes"
	"io"
	"sync"
)

var logMu sync.Mutex

type syncWriter struct{ w io.Writer }

func (s *syncWriter) Write(p []byte) (int, error) {
	logMu.Lock()
	defer logMu.Unlock()
	return s.w.Write(p)
}

func syncRead(b *bytes.Buffer) string {
	logMu.Lock()
	defer logMu.Unlock()
	return b.String()
}
