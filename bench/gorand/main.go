// Command gorand prints the random choices the FGD paper's simulator
// (hkust-adsl/kubernetes-scheduler-simulator) makes when it builds a workload, so that
// bench.placement can give gpusched's cores the very same task sequence for a seed.
//
//	gorand SEED N DRAWS
//
// The simulator seeds Go's global math/rand, draws one Int (a log argument), shuffles its N
// name-sorted pods with rand.Shuffle, then draws rand.Intn(N) per appended pod. Printed: the
// shuffled order of 0..N-1 on the first line, DRAWS values of Intn(N) on the second.
package main

//go:debug randseednop=0

import (
	"bufio"
	"fmt"
	"math/rand"
	"os"
	"strconv"
)

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: gorand SEED N DRAWS")
		os.Exit(2)
	}
	seed, err1 := strconv.ParseInt(os.Args[1], 10, 64)
	n, err2 := strconv.Atoi(os.Args[2])
	draws, err3 := strconv.Atoi(os.Args[3])
	if err1 != nil || err2 != nil || err3 != nil || n <= 0 || draws < 0 {
		fmt.Fprintln(os.Stderr, "gorand: SEED must be an integer, N a positive integer, DRAWS zero or more")
		os.Exit(2)
	}
	rand.Seed(seed)
	_ = rand.Int()
	order := make([]int, n)
	for i := range order {
		order[i] = i
	}
	rand.Shuffle(n, func(i, j int) { order[i], order[j] = order[j], order[i] })
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	for i, v := range order {
		if i > 0 {
			out.WriteByte(' ')
		}
		out.WriteString(strconv.Itoa(v))
	}
	out.WriteByte('\n')
	for i := 0; i < draws; i++ {
		if i > 0 {
			out.WriteByte(' ')
		}
		out.WriteString(strconv.Itoa(rand.Intn(n)))
	}
	out.WriteByte('\n')
}
