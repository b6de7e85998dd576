package vfs

import (
	"testing"
	"unsafe"
)

// TestAIOStructSizes: iocb and ioEvent have the sizes of <linux/aio_abi.h>'s
// struct iocb (64 bytes) and struct io_event (32), with aio_buf, aio_offset
// and aio_resfd at their offsets (24, 40 and 60).
func TestAIOStructSizes(t *testing.T) {
	var cb iocb
	if s := unsafe.Sizeof(cb); s != 64 {
		t.Fatalf("iocb is %d bytes, want 64", s)
	}
	if s := unsafe.Sizeof(ioEvent{}); s != 32 {
		t.Fatalf("io_event is %d bytes, want 32", s)
	}
	if o := [3]uintptr{unsafe.Offsetof(cb.buf), unsafe.Offsetof(cb.offset), unsafe.Offsetof(cb.resfd)}; o != [3]uintptr{24, 40, 60} {
		t.Fatalf("iocb offsets of aio_buf, aio_offset, aio_resfd: %v, want [24 40 60]", o)
	}
}
