//go:build !linux

// Package cgroup gives each sandbox a control group (Linux only).
package cgroup
