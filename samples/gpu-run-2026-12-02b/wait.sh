# Wait up to $1 seconds for the driver, then pack what it wrote so far into $OUT.
end=$(( $(date +%s) + $1 ))
while [ ! -e /tmp/res/ALL_DONE ] && [ $(date +%s) -lt $end ]; do sleep 5; done
cat /tmp/res/progress.txt 2>/dev/null
tail -c 3000 /tmp/res/cuda-tests.log 2>/dev/null | grep -v DEBUG | tail -25
tar czf $OUT/res.tar.gz -C /tmp res 2>/dev/null
ls -la $OUT
