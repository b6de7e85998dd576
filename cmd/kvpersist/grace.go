package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvpersist/kvpersist/engine/jobs"
	"github.com/spf13/pflag"
)

// tempGraceFlag is a --temp-grace value: a duration above 0, or "none"
// (jobs.NoTempGrace: every temp file, whatever its age). 0 is refused
// rather than read as "none": the library reads a grace of 0 as its
// default, so "no grace" has one spelling everywhere.
type tempGraceFlag time.Duration

// addTempGrace defines --temp-grace on fs with its default and help (the
// accepted forms are appended) and returns where its value lands.
func addTempGrace(fs *pflag.FlagSet, def time.Duration, help string) *time.Duration {
	d := def
	fs.Var((*tempGraceFlag)(&d), "temp-grace", help+` (a duration such as 10m, or "none")`)
	return &d
}

func (g *tempGraceFlag) String() string {
	if time.Duration(*g) == jobs.NoTempGrace {
		return "none"
	}
	return time.Duration(*g).String()
}

func (g *tempGraceFlag) Set(s string) error {
	if s == "none" {
		*g = tempGraceFlag(jobs.NoTempGrace)
		return nil
	}
	d, err := time.ParseDuration(s)
	switch {
	case err != nil:
		return errors.New(`want a duration such as 10m, or "none"`)
	case d < 0:
		return errors.New(`must not be negative ("none" keeps no temp file back)`)
	case d == 0:
		return fmt.Errorf(`0 is not a grace: say "none" to keep no temp file back (the default is %v)`, jobs.DefaultTempGrace)
	}
	*g = tempGraceFlag(d)
	return nil
}

func (g *tempGraceFlag) Type() string { return "duration" }
