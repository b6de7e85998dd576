package vfs

// SetAsyncSetup replaces the io_setup of NewAsyncReader until the returned
// function restores it.
func SetAsyncSetup(f func(nr int, ctx *uintptr) error) (restore func()) {
	old := asyncSetup
	asyncSetup = f
	return func() { asyncSetup = old }
}
